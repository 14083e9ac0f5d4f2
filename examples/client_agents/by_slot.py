#!/usr/bin/env python3
"""Run one of several agents per copy, chosen by the copy's slot: ``python by_slot.py A.py B.py C.py`` makes
copy ``k`` (``AGENTRL_AGENT_SLOT``) run the ``k % 3``-th script (with this interpreter, the same environment).
So one run trains on episodes of several clients at once (benchmarks/client_curves.py ``mixed``); each
agent's log (``logs/agent-<slot>.log``) names the sessions it played."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    scripts = sys.argv[1:]
    if not scripts:
        raise SystemExit("usage: by_slot.py AGENT.py [AGENT.py ...]")
    chosen = Path(__file__).with_name(scripts[int(os.environ.get("AGENTRL_AGENT_SLOT", "0")) % len(scripts)])
    print(f"slot {os.environ.get('AGENTRL_AGENT_SLOT')}: {chosen.name}", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, str(chosen)])
