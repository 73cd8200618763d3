"""One-time log lines of the kernels and the dispatcher (padding notices, "auto" decisions)."""

from __future__ import annotations

import logging

_NOTED: set = set()


def log_once(key, message: str, level: int = logging.WARNING) -> None:
  """`message` logged once per `key` for the process, on the `pallas_kernels` logger."""
  if key not in _NOTED:
    _NOTED.add(key)
    logging.getLogger("pallas_kernels").log(level, message)
