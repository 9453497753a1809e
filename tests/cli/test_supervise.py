"""cem-train's supervisor (`cem_jax.cli.supervise`) on the stderr of a training process: C++ log
lines without a fault are passed on; after a fault everything but cem-train's own last line is
diverted; a child that then crashes by itself has the diverted lines shown (its traceback),
one that stops with 75 does not. With real processes: tests/train/test_faults.py."""

import os
import threading

from cem_jax.cli import supervise

GLOG = "E1207 11:59:19.961413   26381 coordination_service_agent.cc:289] "


def _through(lines: list[str]) -> supervise._Child:
    """Feed `lines` as a child's stderr through the supervisor's reader; returns its state."""
    read_end, write_end = os.pipe()
    state = supervise._Child()
    reader = threading.Thread(target=supervise._pass_stderr,
                              args=(os.fdopen(read_end, "rb"), state))
    reader.start()
    with os.fdopen(write_end, "wb") as stream:
        stream.write("".join(lines).encode())
    reader.join(timeout=30)
    return state


def test_cxx_lines_without_a_fault_are_passed_on_in_order(capsys):
    lines = [f"{GLOG}Connected to the coordination service\n", "a warning\n"]
    state = _through(lines)
    assert capsys.readouterr().err == "".join(lines)
    assert not state.fault and state.diverted == []


def test_after_a_fault_only_cem_train_s_own_line_is_passed_on(capsys):
    fault = f"{GLOG}Terminating process because the coordination service has stopped\n"
    lines = ["before\n", fault, "    @ 0x7f stack\n", "Traceback (most recent call last):\n",
             "cem-train: process 1 of 2 lost a peer (exit status 75)\n"]
    state = _through(lines)
    assert state.fault
    assert capsys.readouterr().err == ("before\n"
                                       "cem-train: process 1 of 2 lost a peer (exit status 75)\n")
    assert state.diverted == lines[1:4]


def test_a_crash_after_a_fault_shows_what_was_diverted_and_a_stop_with_75_does_not(capsys):
    state = supervise._Child()
    state.fault, state.diverted = True, ["Traceback (most recent call last):\n", "Error: x\n"]
    assert supervise._ended(75, state) == 75
    assert capsys.readouterr().err == ""
    assert supervise._ended(1, state) == 1
    assert capsys.readouterr().err == "Traceback (most recent call last):\nError: x\n"


def test_a_child_aborted_after_its_own_last_line_keeps_its_status(capsys):
    """Process 0 refused a run directory in use (status 2), then JAX's coordination service
    aborted it in the shutdown barrier: cem-train's status stays 2 (not 75, which launchers
    relaunch), with no second line."""
    fault = f"{GLOG}Terminating process because the coordination service has stopped\n"
    state = _through(["cem-train: error: /r is in use by another cem-train (exit status 2)\n",
                      fault])
    capsys.readouterr()
    assert supervise._ended(-6, state) == 2  # SIGABRT
    assert capsys.readouterr().err == ""
    state.said = None
    assert supervise._ended(-6, state) == 75
