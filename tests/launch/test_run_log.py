"""launch/run_log.py: train.log written only once opened (records held until then, none lost),
and `quiet()` keeping the libraries' reports (what a damaged checkpoint's read printed in issue
33: asyncio error records with tracebacks, never-awaited coroutines, exceptions in threads) off
the terminal and in train.log."""

import logging
import os
import threading

from launch import run_log as run_log_lib


def test_records_wait_for_the_file_and_quiet_reports_go_there_only(tmp_path, capfd):
  terminal = logging.StreamHandler()  # stderr, as launch.train.main installs it
  ours = logging.getLogger("dsv41")
  ours.addHandler(terminal)
  ours.setLevel(logging.INFO)
  rl = run_log_lib.RunLog()
  try:
    logging.getLogger("dsv41.train").info("before the file")
    assert not os.listdir(tmp_path)
    with rl.quiet():
      logging.getLogger("asyncio").error("Task exception was never retrieved", exc_info=(
          RuntimeError, RuntimeError("Event loop is closed"), None))

      async def never_awaited():
        pass
      never_awaited()  # RuntimeWarning: coroutine ... was never awaited, reported at collection
      t = threading.Thread(target=lambda: 1 / 0, name="reader")
      t.start()
      t.join()
      logging.getLogger("dsv41.checkpoint").warning("one line for the terminal")
    rl.open_file(str(tmp_path))
    logging.getLogger("dsv41.train").info("after the file")
    rl.write("done (process 0): steps 0→1 of 1")
  finally:
    rl.close()
    ours.removeHandler(terminal)
  err = capfd.readouterr().err
  assert err.splitlines() == ["before the file", "one line for the terminal", "after the file"]
  log = (tmp_path / "train.log").read_text()
  for text in ("before the file", "Event loop is closed", "was never awaited",
               "ZeroDivisionError", "one line for the terminal", "after the file",
               "done (process 0)"):
    assert text in log, text
  assert log.index("before the file") < log.index("Event loop") < log.index("after the file")
