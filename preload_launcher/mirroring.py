"""Standing for a program that runs in another process (the CLI for its step, a stand-in for
the program it asked the zygote for): every signal the caller sends reaches the program, and
what happens to the program happens to the process standing for it — it stops when the program
stops, and it ends as the program ended, by the same signal included — so that a caller, a
shell or a terminal cannot tell the two apart.

One rule, not a list: every catchable signal is relayed, job control included. The program
runs in a session of the zygote's, so a terminal's signals (sent to its foreground process
group) reach it only through the process standing for it, once. The standard library only:
the stand-in embeds this source.
"""

import os
import signal
import time

__all__ = ["relayed_signals", "Mirror", "die_like", "stop_like", "group_orphaned"]

# Left at their default: SIGKILL and SIGSTOP cannot be caught, SIGCHLD is about our own
# children, and a handler for a fault this process raised itself would return to the faulting
# instruction and loop (sent from outside, they still end the program, through its stand-in).
NOT_RELAYED = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGSEGV, signal.SIGBUS,
               signal.SIGFPE, signal.SIGILL, signal.SIGTRAP, getattr(signal, "SIGSYS", 31)}


# Stops the kernel discards, in an orphaned process group, for a process that takes them at
# their default disposition (POSIX: nobody is left to continue the group).
JOB_CONTROL_STOPS = {signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU}


def group_orphaned() -> bool:
    """Whether this process's group is orphaned: no member has a parent in another group of
    the same session (a caller's ``start_new_session``; a job whose shell is gone). The
    program stands in the zygote's session, whose groups never are: what the kernel does to a
    stop there is done here, for it. False where ``/proc`` cannot tell."""
    own_group, session = os.getpgrp(), os.getsid(0)
    processes = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return False
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        processes[int(name)] = (int(fields[1]), int(fields[2]), int(fields[3]), fields[0])
    for parent_pid, group, _, state in processes.values():
        # As the kernel counts: not a member that is exiting, nor one whose parent is init.
        if group != own_group or state in ("Z", "X") or parent_pid == 1:
            continue
        parent = processes.get(parent_pid)
        if parent is not None and parent[1] != own_group and parent[2] == session:
            return False
    return True


def catches(pid, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (unknown pid: assumed so, which
    relays as before)."""
    if pid is None:
        return True
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return bool(int(fields["SigCgt"], 16) >> (signum - 1) & 1)
    except (OSError, KeyError, ValueError):
        return True


def relayed_signals() -> list:
    """Every signal a process standing for a program relays to it."""
    return sorted(int(s) for s in signal.valid_signals() if s not in NOT_RELAYED)


def die_like(returncode: int) -> None:
    """End this process as the program ended: ``os._exit`` for codes >= 0; a negative code -N
    ends it by signal N (at its default disposition), as the parent's ``waitpid`` then reports
    it (python itself does this for KeyboardInterrupt; a shell and ``env`` end so too)."""
    if returncode < 0:
        signum = -returncode
        try:
            if signum not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(signum, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
            os.kill(os.getpid(), signum)
            time.sleep(5)  # another thread may take it; the process ends all the same
        except (OSError, ValueError):
            pass
        returncode = 128 + signum  # one whose default is to be ignored: the shell's code
    os._exit(returncode & 0xFF)


def stop_like(signum: int) -> None:
    """Stop this process with the signal that stopped the program; returns once continued."""
    if signum == signal.SIGSTOP:
        os.kill(os.getpid(), signum)
        return
    before = signal.signal(signum, signal.SIG_DFL)
    try:
        os.kill(os.getpid(), signum)  # delivered (and stopped on) before kill returns
    finally:
        signal.signal(signum, before)


class Mirror:
    """Relays every catchable signal through ``relay(signum)`` while installed, and stops when
    the program stops (``on_stopped``). Installed before the program starts (``relay`` None),
    it holds what arrives until ``relay_to`` names where the program is: a program may say
    it is ready before its caller's process would otherwise have its handlers, and a signal
    sent then must reach the program, not end the process standing for it. A ``stopped``
    report that a SIGCONT relayed after it overtakes is not mirrored: the program is running
    again (a caller's TSTP then CONT in quick succession must not leave this process stopped)."""

    def __init__(self, relay=None) -> None:
        self.relay = relay
        self.held: list = []  # received, not relayed yet
        self.sent = 0  # signals relayed so far, in order
        self.last_cont = 0  # the number of the last SIGCONT relayed
        self.before: dict = {}
        self.skip: set = set()
        self.program = lambda: None  # the program's pid, once known (its handlers are read)

    def install(self, skip=()) -> None:
        """Take every relayed signal but ``skip``; before ``relay_to``, not those ignored now:
        a program started meanwhile (or whose attributes are read) inherits them ignored, as
        from its caller."""
        self.skip = set(skip)
        self._take(ignored_too=self.relay is not None)

    def relay_to(self, relay) -> None:
        """The program runs: what was held goes to it first, in order, then every signal."""
        self.relay = relay
        self._take(ignored_too=True)
        self._flush()

    def _take(self, ignored_too: bool) -> None:
        for signum in set(relayed_signals()) - self.skip - set(self.before):
            try:
                if ignored_too or signal.getsignal(signum) != signal.SIG_IGN:
                    self.before[signum] = signal.signal(signum, self._on_signal)
            except (OSError, ValueError):  # one the platform reserves
                pass

    def uninstall(self) -> None:
        """The previous handlers again; a signal still held (no program ever ran) is taken
        by this process as it would have been without us."""
        for signum, handler in self.before.items():
            signal.signal(signum, handler)
        self.before.clear()
        held, self.held = self.held, []
        for signum in held:
            os.kill(os.getpid(), signum)

    def _on_signal(self, signum, _frame) -> None:
        self.held.append(signum)
        if self.relay is not None:
            self._flush()

    def _flush(self) -> None:
        # A handler may run between any two steps here, and flush what it finds itself.
        while True:
            try:
                signum = self.held.pop(0)
            except IndexError:
                return
            if signum in JOB_CONTROL_STOPS and not catches(self.program(), signum) \
                    and group_orphaned():
                continue  # the kernel discards it for a program in our place
            self.sent += 1
            if signum == signal.SIGCONT:
                self.last_cont = self.sent
            self.relay(signum)

    def on_stopped(self, signum: int, relayed_before: int) -> None:
        """The program stopped, with ``relayed_before`` of our signals delivered to it."""
        if self.last_cont > relayed_before:
            return
        if signum != signal.SIGSTOP and group_orphaned():
            # A stop in our place would have been discarded, and ours would be: the program
            # goes on (kept stopped, with nobody to continue it, its caller would wait forever).
            self.held.append(signal.SIGCONT)
            self._flush()
            return
        stop_like(signum)
