#!/usr/bin/python3
"""Push journal entries to Loki (POST <url>/loki/api/v1/push), as rsyslog's omprog program.

rsyslog (the shardstack log forwarder) writes one JSON object a line ({"ts", "host", "unit", "message"}) inside
transactions: BEGIN TRANSACTION, the entries, COMMIT TRANSACTION. This program answers OK to the begin mark,
DEFER_COMMIT to each entry, and to the commit mark OK only once Loki accepted the whole batch (2xx); any other answer
makes rsyslog keep the batch in its disk-assisted queue and retry it, so nothing is lost while Loki is down.
Standard library only (the collector's /usr/bin/python3). The credentials (`user:password`, root-only file) are
read here, never put on a command line or in rsyslog's configuration.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import ssl
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

BEGIN, COMMIT = "BEGIN TRANSACTION", "COMMIT TRANSACTION"


def _ns(ts: str | None) -> str:
    try:
        return str(int(datetime.datetime.fromisoformat(ts).timestamp() * 1e9)) if ts else str(time.time_ns())
    except ValueError:
        return str(time.time_ns())


def payload(entries: list[dict], labels: dict[str, str]) -> dict:
    """Loki's push body: one stream per (host, unit), each with its [timestamp ns, line] values in order."""
    streams: dict[tuple[str, str], list[list[str]]] = {}
    for e in entries:
        key = (str(e.get("host") or "unknown"), str(e.get("unit") or ""))
        streams.setdefault(key, []).append([_ns(e.get("ts")), str(e.get("message", ""))])
    return {"streams": [{"stream": {**labels, "host": host, **({"unit": unit} if unit else {})}, "values": values}
                        for (host, unit), values in streams.items()]}


class Sender:
    def __init__(self, config: dict) -> None:
        self.url = config["url"].rstrip("/") + "/loki/api/v1/push"
        self.labels = {str(k): str(v) for k, v in (config.get("labels") or {}).items()}
        self.headers = {"Content-Type": "application/json"}
        if config.get("credentials_file"):
            secret = Path(config["credentials_file"]).read_text().strip()
            self.headers["Authorization"] = "Basic " + base64.b64encode(secret.encode()).decode()
        self.context = ssl.create_default_context(cafile=config.get("ca_file") or None)

    def push(self, entries: list[dict]) -> str:
        if not entries:
            return "OK"
        body = json.dumps(payload(entries, self.labels)).encode()
        req = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=20, context=self.context) as resp:
                return "OK" if 200 <= resp.status < 300 else f"Error: HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            return f"Error: HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            return f"Error: {exc}".replace("\n", " ")


def serve(sender: Sender, stdin=sys.stdin, stdout=sys.stdout) -> None:
    def say(word: str) -> None:
        stdout.write(word + "\n")
        stdout.flush()

    say("OK")  # ready
    batch: list[dict] = []
    for line in stdin:
        line = line.rstrip("\n")
        if line == BEGIN:
            batch = []
            say("OK")
        elif line == COMMIT:
            say(sender.push(batch))
            batch = []
        else:
            try:
                batch.append(json.loads(line))
            except ValueError:
                batch.append({"message": line})
            say("DEFER_COMMIT")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="JSON: url, labels, credentials_file, ca_file")
    serve(Sender(json.loads(Path(ap.parse_args().config).read_text())))


if __name__ == "__main__":
    main()
