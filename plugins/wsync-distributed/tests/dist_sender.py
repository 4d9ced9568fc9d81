"""A sender process for the tests: ``python dist_sender.py '<json>'`` builds a scheme from the
options given, connects to ``workers`` receivers and sends versions 1, 2, ... one after the other
(every tensor filled with the version), printing {"event": "sent", "version": v} after each, until
it is killed or ``until`` is reached."""

from __future__ import annotations

import json
import sys

from wsync_core import WeightSyncScheme, WsyncError

from dist_worker import weights


def main() -> None:
    cfg = json.loads(sys.argv[1])
    scheme = WeightSyncScheme("distributed", timeout=cfg.get("timeout", 60.0), **cfg["options"])
    w = weights(cfg.get("variant", "base"), 0.0)
    scheme.init_on_sender(weights=w, num_workers=cfg["workers"])
    try:
        scheme.connect()
        print(json.dumps({"event": "sent", "version": 0}), flush=True)
        for v in range(1, cfg.get("until", 1 << 30) + 1):
            for t in w.values():
                t.fill_(v)
            scheme.send()
            print(json.dumps({"event": "sent", "version": v}), flush=True)
    except WsyncError as exc:
        print(json.dumps({"event": "error", "type": type(exc).__name__, "message": str(exc)}), flush=True)
    finally:
        scheme.shutdown()


if __name__ == "__main__":
    main()
