"""Subprocesses of the tests that run the launcher: started in a group, never waited on forever."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

HARD_TIMEOUT = 150.0  # seconds, per subprocess


def start(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
  """Starts ``command`` in a process group of its own, its output piped as text."""
  return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, start_new_session=True, text=True)


def finish(proc: subprocess.Popen, timeout: float = HARD_TIMEOUT) -> tuple[int, str, str, float]:
  """Waits at most ``timeout`` s; on expiry SIGKILLs the process group and fails.

  Returns:
    ``(exit code, stdout, stderr, seconds waited)``.
  """
  begin = time.monotonic()
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    pytest.fail(f"timed out after {timeout} s (killed)\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
  return proc.returncode, out, err, time.monotonic() - begin
