"""`<log_dir>/transitions.jsonl`: one JSON line per server transition, with its time, so that a run that left
the server down can be diagnosed afterwards and the report can show how long the server was away."""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE = "transitions.jsonl"


class Transitions:
    """The transitions log of one server (its kind and base_url go into every entry)."""

    def __init__(self, log_dir: Path, kind: str, base_url: str) -> None:
        self.path = Path(log_dir) / FILE
        self.kind, self.base_url = kind, base_url

    def record(self, event: str, **extra: Any) -> None:
        """Append one transition (and say it in the Python log)."""
        now = datetime.now().astimezone()
        entry = {
            "time": now.isoformat(timespec="milliseconds"),
            "unix": round(now.timestamp(), 3),
            "event": event,
            "kind": self.kind,
            "base_url": self.base_url,
            "by_pid": os.getpid(),
            **extra,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
        log.info("server %s: %s %s", self.base_url, event, json.dumps(extra) if extra else "")
